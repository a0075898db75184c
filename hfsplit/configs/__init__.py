"""Bundled public config.json files of a few well-known models (no weights).

They let `hfsplit plan` answer for these names with no network, and carry the
published parameter counts that the cost model is tested against.
"""
