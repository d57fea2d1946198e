"""PolyGateway middleware package."""
