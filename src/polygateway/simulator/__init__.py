"""PolyGateway simulator package."""
