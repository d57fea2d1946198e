"""PolyGateway backends package."""
