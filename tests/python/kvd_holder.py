"""A client that takes hold of things and then waits to be killed (a crashed engine, for the
tests of SPEC 4's "Sessions"): written from the SPEC alone, with kvd_spec_client.

    python3 kvd_holder.py ENDPOINT stream|zmq LAYOUT_JSON PARAMS_HEX PIN_KEY_HEX ALLOC_KEY_HEX \
        EXPORT_KEY_HEX

Says `hello` (and, with `stream`, moves to the stream transport), registers the layout,
admits a pull of PARAMS (a deferred pull: its daemon keeps the export's lease alive),
pins PIN_KEY for 60 s, allocates ALLOC_KEY without committing it, stores EXPORT_KEY
(block bytes `i % 251`) and exports it as `holder-export-<mode>`, prints `holding
CLIENT_ID EXPORT_PARAMS_HEX`, and sleeps until it is killed.
"""

import json
import sys
import time

import msgpack

from kvd_spec_client import Client


def main():
    endpoint, mode, layout, params_hex, pin_key, alloc_key, export_key = sys.argv[1:8]
    c = Client(endpoint)
    h = c.hello("holder")
    if mode == "stream":
        c.use_stream()
    reg = c.register_layout(json.loads(layout))
    lid = reg["layout_id"]
    params = msgpack.unpackb(bytes.fromhex(params_hex), raw=False)
    client = h["client"]
    ok, _ = c.call("pull", {"client": client, "params": params, "wait": False, "defer": True})
    assert ok["state"] in ("queued", "running", "waiting"), ok
    ok, _ = c.call("get", {"client": client, "layout_id": lid, "keys": [bytes.fromhex(pin_key)],
                           "ttl_ms": 60000})
    assert ok["pin"] is not None, ok
    ok, _ = c.call("alloc", {"client": client, "layout_id": lid, "keys": [bytes.fromhex(alloc_key)]})
    assert ok["status"] == ["new"], ok
    k = [bytes.fromhex(export_key)]
    c.call("alloc", {"client": client, "layout_id": lid, "keys": k})
    data = bytes(i % 251 for i in range(reg["block_bytes"]))
    c.call("commit", {"client": client, "layout_id": lid, "keys": k}, payloads=[data])
    ok, _ = c.call("export", {"client": client, "transfer_id": f"holder-export-{mode}", "layout_id": lid,
                              "keys": k, "lease_ms": 60000})
    exported = msgpack.packb(ok["params"], use_bin_type=True).hex()
    print(f"holding {client} {exported}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
