#!/bin/sh
# Copies lua/shared.lua into the marked block of every script. Run it after editing
# shared.lua; tests/lua/lua_features.rs fails while a copy differs.
set -eu
cd "$(dirname "$0")"
for f in *.lua; do
  [ "$f" = shared.lua ] && continue
  grep -q '^-- >>> shared' "$f" || continue
  awk -v shared=shared.lua '
    /^-- >>> shared/ { while ((getline line < shared) > 0) print line; close(shared); skip = 1; next }
    /^-- <<< shared <<</ { skip = 0; next }
    !skip { print }
  ' "$f" > "$f.tmp"
  mv "$f.tmp" "$f"
done
