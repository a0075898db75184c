"""Deciding a split on a laptop, no GPU and no weights: budgets' reserve, the cost model (`costs`), the time model
(`timing`, `links`) and the solver (`planner`). Never imports apply/, parallel/, load/ or training/."""
