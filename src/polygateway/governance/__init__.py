"""PolyGateway governance package."""
