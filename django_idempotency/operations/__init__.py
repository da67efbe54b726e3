"""Running the package in production: system checks, metrics, tracing and correlation ids."""
