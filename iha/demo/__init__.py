"""`iha demo`: convert the built-in SmolLM2, verify it, fine-tune briefly, evaluate and save (`pipeline`)."""
