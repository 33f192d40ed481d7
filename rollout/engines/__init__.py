"""Policy engines: vLLM, transformers and scripted, behind one contract (``base.PolicyEngine``)."""
