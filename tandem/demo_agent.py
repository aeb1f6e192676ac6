"""The agent demo's agent: the tool demo's task (three-digit sums, with the calculator) written as
an OpenAI Agents SDK agent, the way one is written for any OpenAI-compatible endpoint. tandem
trains it unchanged: `tandem demo --task agent` (tandem/demo_agent.yaml: `agent_func:
tandem.demo_agent:solve`). Needs `pip install 'tandem-rl[agents]'`."""

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from tandem.rollout.tools import calculator as evaluate

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's servers


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: The expression, e.g. 347+589.
    """
    return evaluate(expression)


async def solve(row, client):
    """One episode: the question to the agent, which may call the calculator once, then answers.
    The reward is exact_match's on its last message (tandem/demo_agent.yaml)."""
    agent = Agent(name="adder", model=OpenAIChatCompletionsModel(model="policy", openai_client=client), tools=[calculator])
    try:
        await Runner.run(agent, row["prompt"][-1]["content"], max_turns=2)
    except MaxTurnsExceeded:  # a second call instead of an answer: the episode ends, scored on what it said
        pass
