"""The three ways into multi-turn rollouts (docs/multi-turn.md), on the demo's addition task."""


def digit_sum(number: int) -> int:
    """Add up the decimal digits of a whole number.

    Args:
        number: The number whose digits to add.
    """
    return sum(int(d) for d in str(abs(number)))


class SecondChance:
    """A dialogue that is not tool calls: a wrong answer gets one more try, worth half."""

    def reset(self, answer: str, **row):
        self.answer, self.tries, self.solved = answer, 0, False
        return None  # nothing to add to the prompt

    def step(self, text: str):
        self.tries += 1
        self.solved = text.strip() == self.answer
        if self.solved or self.tries == 2:
            return None  # the trajectory ends
        return "Wrong. Try once more."

    def get_reward(self) -> float:
        return (1.0 if self.tries == 1 else 0.5) if self.solved else 0.0


async def answer_then_check(prompt, generate, tokenizer):
    """A user's own agent: answer, then, past a note of its own, say whether it is sure."""
    first = await generate(prompt["prompt_ids"])
    note = tokenizer("\nSure? ", add_special_tokens=False)["input_ids"]
    second = await generate(prompt["prompt_ids"] + first["token_ids"] + note, max_tokens=4)
    return {
        "completion_ids": first["token_ids"] + note + second["token_ids"],
        "loss_mask": [1] * len(first["token_ids"]) + [0] * len(note) + [1] * len(second["token_ids"]),
        "messages": [{"role": "assistant", "content": tokenizer.decode(first["token_ids"], skip_special_tokens=True)}],
    }

