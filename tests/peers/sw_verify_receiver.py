"""A loopback webhook receiver that checks every delivery with the official Standard Webhooks
verifier (the `standardwebhooks` package from PyPI), used by tests/standard_webhooks.rs.

For each POST it records one JSON line in --out:
  id, signatures (how many the header carries), new_ok (verifies with --new),
  old_ok (verifies with --old), tampered_ok (the body with one byte changed verifies with --new)
and answers 200 when the real body verifies with --new, 401 otherwise.
It prints "PORT <n>" on stdout once it listens on 127.0.0.1.
"""
import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


def verifies(secret, body, headers):
    if not secret:
        return False
    try:
        Webhook(secret).verify(body, headers)
        return True
    except WebhookVerificationError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", required=True)
    ap.add_argument("--old", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            n = int(self.headers.get("content-length", "0"))
            body = self.rfile.read(n)
            headers = {k: v for k, v in self.headers.items()}
            # Flip one byte inside the JSON: same length, still valid UTF-8.
            tampered = body.replace(b'"zoning.change"', b'"zoning.chbnge"', 1)
            rec = {
                "id": headers.get("webhook-id") or headers.get("Webhook-Id"),
                "signatures": len((self.headers.get("webhook-signature") or "").split()),
                "new_ok": verifies(args.new, body, headers),
                "old_ok": verifies(args.old, body, headers),
                "tampered_ok": verifies(args.new, tampered, headers) or verifies(args.old, tampered, headers),
                "tampered_differs": tampered != body,
            }
            with lock, open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.send_response(200 if rec["new_ok"] else 401)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
