"""kvagentd: a tiered KV-cache agent daemon for unattended industrial edge PCs."""

__version__ = "0.1.0"
