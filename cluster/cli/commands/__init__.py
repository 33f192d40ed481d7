"""Sub-commands of the turnstile CLI."""
