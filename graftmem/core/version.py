"""The package version, kept at the bottom layer so that every layer can name it in what it writes
(bundle manifests, the server's /v1/info) without importing the package facade."""

__version__ = "0.5.0.dev0"
