"""Search backends (local index, Serper-compatible API, retrieval server) and the search tool."""
