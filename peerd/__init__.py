"""peerd: a peer-to-peer volunteer-compute daemon for decentralized training of neural networks."""

__version__ = "0.1.0"
