"""gpu_worker package."""
