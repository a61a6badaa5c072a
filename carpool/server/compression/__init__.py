"""LLMLingua-style prompt compression scored by a small served model (see compressor.py and service.py)."""

from carpool.server.compression.compressor import Budget, Compressed, Piece, Scorer, compress
from carpool.server.compression.service import CompressionService

__all__ = ["Budget", "Compressed", "CompressionService", "Piece", "Scorer", "compress"]
