#!/usr/bin/env bash
# Makes the TLS material of a podsim job that spans machines (see README, "Across machines"):
# a certificate authority for the job and one certificate it signs, valid for both ends of
# every connection (server and client) under one name. Every process of the job gets
# ca.pem, node.pem and node.key; ca.key signs more certificates and stays with whoever
# makes them.
#
#   scripts/tls_certs.sh DIR [NAME] [DAYS]     # NAME: server_name (default podsim); DAYS: 365
set -euo pipefail
dir=${1:?usage: tls_certs.sh DIR [NAME] [DAYS]}
name=${2:-podsim}
days=${3:-365}
mkdir -p "$dir"
cd "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '[req]\ndistinguished_name=dn\n[dn]\n[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n' >"$tmp/ca.cnf"
printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:%s\n' "$name" >"$tmp/node.ext"
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key
openssl req -new -x509 -key ca.key -out ca.pem -days "$days" -subj "/CN=podsim job CA" \
    -extensions ca -config "$tmp/ca.cnf"
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out node.key
openssl req -new -key node.key -out "$tmp/node.csr" -subj "/CN=$name"
openssl x509 -req -in "$tmp/node.csr" -CA ca.pem -CAkey ca.key -CAcreateserial \
    -CAserial "$tmp/ca.srl" -out node.pem -days "$days" -extfile "$tmp/node.ext" 2>/dev/null
chmod 600 ca.key node.key
echo "$dir: ca.pem, node.pem, node.key (server_name \"$name\", $days days); ca.key signs more"
