"""Target models: one protocol (base.py), the Hugging Face adapter (hf.py) and the native Llama family (native/)."""
