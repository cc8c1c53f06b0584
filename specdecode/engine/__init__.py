"""The engine layer: one batched engine (`LLMEngine`) that every entry point drives, with its
scheduler, paged KV cache and block pool, load policy, drafter factory and detokenizer.

Submodules are imported directly (`from specdecode.engine.llm_engine import LLMEngine`): this
package's `__init__` imports nothing, so the layers below it never pull the engine in.
"""
