"""The generation engines behind one small interface (tandem.engines.engine.Engine): tandem's own
transformers decode loop, and vLLM."""
