"""The local development environment: tool builds from source and a local control plane."""
