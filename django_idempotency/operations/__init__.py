"""Running the package in production: system checks, metrics and tracing."""
