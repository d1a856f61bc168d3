"""Derives the CRD variants the tests need from the Cluster API CRDs as shipped.

usage: crd_variants.py RENAMED_GROUP OUT_DIR SHIPPED.yaml...
writes OUT_DIR/v1beta1/<file> (only v1beta1, as storage) and OUT_DIR/renamed/<file>
(the shipped versions under RENAMED_GROUP).
"""
import os
import sys

import yaml

UPSTREAM_GROUP = "cluster.x-k8s.io"


def only_version(crd, name):
    versions = [v for v in crd["spec"]["versions"] if v["name"] == name]
    if len(versions) != 1:
        raise SystemExit(f"{crd['metadata']['name']}: no version {name}")
    versions[0]["storage"] = True
    versions[0].pop("deprecated", None)
    versions[0].pop("deprecationWarning", None)
    crd["spec"]["versions"] = versions
    return crd


def renamed(crd, group):
    crd["spec"]["group"] = group
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{group}"
    return crd


def main():
    group, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    for path in files:
        base = os.path.basename(path)
        with open(path) as f:
            text = f.read()
        for variant, transform in (
            ("v1beta1", lambda c: only_version(c, "v1beta1")),
            ("renamed", lambda c: renamed(c, group)),
        ):
            crd = transform(yaml.safe_load(text))
            name = base.replace(UPSTREAM_GROUP, group) if variant == "renamed" else base
            with open(os.path.join(out, variant, name), "w") as f:
                yaml.safe_dump(crd, f, sort_keys=False)


if __name__ == "__main__":
    main()
