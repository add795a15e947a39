"""The store's exceptions. Every message names the entry and says what was expected and found.

The connector catches `StoreError` on load and turns it into "recompute" (vLLM's
`failed_recving`); the subclasses let it log why.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidAnchor(StoreError, ValueError):
    """An anchor name that is empty, too long, or has characters outside the allowed set."""


class EntryNotFound(StoreError, KeyError):
    """No committed entry at that id (it never existed, was deleted or evicted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptEntry(StoreError):
    """A chunk or the manifest is missing, truncated, or fails its crc32c checksum."""

    def __init__(self, entry: str, what: str) -> None:
        super().__init__(f"entry {entry}: {what}")
        self.entry = entry


class OtherFormat(CorruptEntry):
    """An entry of another format version: listed and removable, never loaded."""

    def __init__(self, entry: str, version: object, readable: tuple[int, ...]) -> None:
        """`readable`: the format versions this anchorkv reads (the manifest reader's)."""
        self.version = version
        #: written by a newer anchorkv (its readers use it; this one leaves it alone)
        self.newer = isinstance(version, int) and version > max(readable)
        readable_text = ", ".join(map(str, readable))
        if self.newer:
            what = (f"format version {version}, newer than the versions this anchorkv reads ({readable_text}): "
                    "upgrade anchorkv to load it (this one leaves it alone)")
        else:
            what = (f"format version {version}, this anchorkv reads versions {readable_text}: it is "
                    "never loaded; `anchorkv gc` or `anchorkv rm` removes it")
        super().__init__(entry, what)


class FingerprintMismatch(StoreError):
    """The entry was written for another model (layers, field shapes or dtypes differ)."""


class IncompleteEntry(StoreError):
    """`commit` was called before every rank wrote its part, or a rank's part is missing chunks."""


class FormatError(StoreError, ValueError):
    """A codec, layout or field that the entry format cannot represent (e.g. an unknown codec)."""


class StoreUnavailable(StoreError):
    """The store cannot be opened or used: missing, not a store, not writable, unreachable,
    no credentials, a backend that is not installed. The message says what to do."""


def explain(e: BaseException, url: str) -> str:
    """One or two lines for an error a backend raised on `url`: what was expected, what was
    found, the fix (which extra to install, which ``storage_options`` key, permissions)."""
    import errno as _errno

    text = str(e)
    low = text.lower()
    first = text.strip().splitlines()[0][:240] if text.strip() else type(e).__name__
    if isinstance(e, StoreError):
        return text
    if isinstance(e, ModuleNotFoundError) and "obstore" in text:
        return (f"{url}: an s3:// store needs the S3 extra, found no 'obstore' module; "
                "install it: pip install 'anchorkv[s3]'")
    if ("169.254.169.254" in text or "credential" in low
            or ("no such file or directory (os error 2)" in low and "token" in low)):
        return (f"{url}: no S3 credentials were found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "pass storage_options {\"access_key_id\": ..., \"secret_access_key\": ...} (connector: "
                "kv_connector_extra_config.storage_options)")
    if type(e).__name__ == "UnknownConfigurationKeyError":
        return (f"{url}: {first.rstrip('.')}; expected S3 storage_options such as endpoint, region, access_key_id, "
                "secret_access_key, session_token, allow_http (fix the key's spelling)")
    if "nosuchbucket" in low:
        return f"{url}: the bucket does not exist; create it, or fix the bucket name in the URL"
    if "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low:
        code = "InvalidAccessKeyId" if "invalidaccesskeyid" in low else "SignatureDoesNotMatch"
        return (f"{url}: the S3 credentials were refused ({code}); "
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options access_key_id / secret_access_key")
    if "accessdenied" in low or "403 forbidden" in low:
        return (f"{url}: access denied by the object store; the credentials need read and write permission on "
                "the bucket and prefix")
    if "error sending request" in low or "connection refused" in low or "dns error" in low or "timed out" in low:
        return (f"{url}: cannot reach the object store ({first[:120]}); check the endpoint "
                "(storage_options 'endpoint' or ?endpoint= in the URL) and the network")
    if isinstance(e, PermissionError):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return (f"{url}: permission denied{where}; this user cannot read or write it there: fix the store's "
                "permissions, or use another store (--store / 'store')")
    if isinstance(e, OSError) and e.errno == _errno.EROFS:
        return f"{url}: the file system is read-only; use a store on a writable file system (--store / 'store')"
    if isinstance(e, OSError) and e.errno == _errno.ENOSPC:
        return f"{url}: no space left on the device; free space (anchorkv gc --capacity SIZE) or use another store"
    return f"{url}: {type(e).__name__}: {first}"
