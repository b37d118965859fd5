"""Model loading (HF path or the embedded tiny default) and model surgery."""
