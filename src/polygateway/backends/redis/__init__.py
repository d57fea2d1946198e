"""PolyGateway backends/redis package."""
