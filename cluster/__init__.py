"""turnstile command line."""
