"""PolyGateway transport package."""
