"""The CB engine layer: transformers' continuous-batching engine and what runs next to it (no trl_cb policy)."""
