"""Drafter training: data, the target's hidden states, and one training loop per method.

- `data`: ShareGPT conversations -> chat-templated token sequences with a mask of the tokens the
  assistant wrote (the ones a drafter learns to predict).
- `features`: the target's final hidden states over those sequences (or over its own greedy
  answers, for self-distillation), computed in batches and cached on disk.
- `medusa`: Medusa heads on those features; `specdecode train medusa`.

Each method's loop reads the same cached features, so EAGLE or ReDrafter heads reuse the first
two rooms as they are.
"""
