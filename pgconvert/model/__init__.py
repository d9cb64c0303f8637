"""The model description: the grid of fake process groups, parallel layouts (and layout strings), ModelConfig, the provider, the sharding rules."""
