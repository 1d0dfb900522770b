"""Deployment: the container image, Kubernetes manifests, scale-out on Ray Serve."""
