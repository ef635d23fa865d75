"""pagedserve: LLM serving on Ray built around PagedAttention."""

__version__ = "0.1.0"
