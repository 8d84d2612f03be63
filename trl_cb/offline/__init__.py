"""Offline fixtures: tiny random models, a local tokenizer and GSM8K prompts, with no download."""
