"""A stand-in for SGLang in tests/test_sglang_engine.py (SGLang cannot be installed here)."""
