"""Up-front checks: which models and which generation settings the CB engine serves exactly."""
