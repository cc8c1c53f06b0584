"""Serving: many requests on one target model, batched into one forward per step (in-flight
batching), over a paged KV cache whose full blocks are reused across requests sharing a prefix."""
