"""Share: moving blocks between stores. One streaming checker (`.manifest`), one admission path
for import, pull and push (`.admission`), bundle files (`.bundle`), keys, signatures and the
trust policy (`.trust`), and the HTTP client (`.client`).

Public: the functions the CLI and benches call without loading a model (export, push), and the models
they return.
"""

from .admission import Admission, AdmissionPlan, Staging
from .bundle import export, import_bundle, import_stream
from .client import LISTING_DOMAIN, SIGNATURE_HEADER, fetch_listing, pull, push
from .manifest import (MANIFEST_NAME, SIGNATURE_NAME, BlockChecker, BundleEntry, BundleManifest, ExportReport,
                       TransferReport, listing, select)
from .trust import PublicKey, Signature, SigningKey, TrustPolicy, TrustResult

__all__ = [
    "Admission", "AdmissionPlan", "BlockChecker", "BundleEntry", "BundleManifest", "ExportReport", "LISTING_DOMAIN",
    "MANIFEST_NAME", "PublicKey", "SIGNATURE_HEADER", "SIGNATURE_NAME", "Signature", "SigningKey", "Staging",
    "TransferReport", "TrustPolicy", "TrustResult", "export", "fetch_listing", "import_bundle", "import_stream",
    "listing", "pull", "push", "select"]
