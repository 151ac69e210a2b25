"""The runtime: block pool and KV-cache manager, scheduler, sequences and sampling, engines, `LLM`.

A step is schedule -> run -> postprocess (`llm_engine.LLMEngine.step`); the
backend behind `engines.Engine` only ever sees packed step tensors.
"""
