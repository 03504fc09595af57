"""laneserve package."""
