"""The runtime: block pool and KV-cache manager, scheduler, sequences and sampling, engines, `LLM`.

A step is schedule -> run -> sample -> update -> outputs (`llm_engine.LLMEngine.step`); the
runner behind `engines.ModelRunner` only ever sees packed step tensors.
"""
