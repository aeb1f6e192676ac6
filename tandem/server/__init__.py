"""The rollout server (`tandem rollout`): its HTTP app and routes (app), their pydantic models
(protocol), the serving logic behind them (serving) and its command-line options (options)."""
