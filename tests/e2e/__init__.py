"""End-to-end runners against the real Kubernetes of ../shared/realk8s (not pytest tests)."""
