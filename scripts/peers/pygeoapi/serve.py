"""pygeoapi test peer for zonewatch: serves the OGC API - Features configured in
$PYGEOAPI_CONFIG (with $PYGEOAPI_OPENAPI already generated) on 127.0.0.1:<port>, as one
process (no reloader, no debugger), so the test can stop it by its pid.
Usage: python serve.py <port>"""
import sys

from pygeoapi.flask_app import APP

APP.run(host="127.0.0.1", port=int(sys.argv[1]), debug=False, use_reloader=False)
