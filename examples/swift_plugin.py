"""An ms-swift reward plugin, as ms-swift's own are written (examples/train/grpo/plugin/): a class
registered under a name in `orms`. `tandem train --external_plugins examples/swift_plugin.py
--reward_funcs boxed` imports it and scores with it; ms-swift need not be installed."""

import re

from swift.rewards import ORM, orms


class Boxed(ORM):
    """1.0 when the completion puts an answer in \\boxed{...}, the format math-verify reads first."""

    def __call__(self, completions, **kwargs) -> list[float]:
        return [1.0 if re.search(r"\\boxed\{[^}]+\}", completion) else 0.0 for completion in completions]


orms["boxed"] = Boxed
