"""Verifies one webhook request with a PyPI library we did not write: `standardwebhooks`
or `svix`. stdin: JSON {library, secret, body (base64), headers}. Prints "verified" and
exits 0, or exits non-zero with the library's error. Run by tests/common/verifiers.rs."""
import base64
import json
import sys

data = json.load(sys.stdin)
body = base64.b64decode(data["body"])
if data["library"] == "svix":
    from svix.webhooks import Webhook
else:
    from standardwebhooks.webhooks import Webhook
Webhook(data["secret"]).verify(body, data["headers"])
print("verified")
