#!/usr/bin/env bash
# The Grafana dashboards: generated from deploy/grafana/dashboards.py (the files are up to date),
# and each one type-checks as @grafana/schema's Dashboard with tsc --strict (an object literal
# of that type, so unknown fields are errors too). A misspelt field must fail the same check.
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
cache="$("$src/deploy/tools/npm_tools.sh")"
work="$(mktemp -d "$cache/dashboards.XXXXXX")"  # inside the cache: node_modules resolves from it
trap 'rm -rf "$work"' EXIT

mkdir "$work/gen"
python3 "$src/deploy/grafana/dashboards.py" "$work/gen"
for f in "$work"/gen/*.json; do
  diff -u "$src/deploy/grafana/$(basename "$f")" "$f" ||
    { echo "FAIL: deploy/grafana/$(basename "$f") is not what dashboards.py writes; run it" >&2; exit 1; }
done

cat > "$work/tsconfig.json" <<'JSON'
{ "compilerOptions": { "strict": true, "noEmit": true, "module": "esnext", "moduleResolution": "bundler",
                       "target": "es2022", "skipLibCheck": true, "types": [] },
  "include": ["*.ts"] }
JSON
n=0
for f in "$src"/deploy/grafana/*.json; do
  name="$(basename "$f" .json | tr -c 'a-zA-Z0-9\n' _)"
  { echo "import type { Dashboard } from '@grafana/schema';"
    echo "export const ${name}: Dashboard = $(cat "$f");"; } > "$work/$name.ts"
  n=$((n + 1))
done
[ "$n" -ge 2 ] || { echo "FAIL: expected the dashboards under deploy/grafana, found $n" >&2; exit 1; }
tsc="$cache/node_modules/.bin/tsc"
(cd "$work" && "$tsc" -p tsconfig.json) || { echo "FAIL: a dashboard does not type-check" >&2; exit 1; }
echo "ok: $n dashboards type-check against @grafana/schema $(node -p "require('$cache/node_modules/@grafana/schema/package.json').version")"

# Not vacuous: a misspelt panel field is rejected by the same compiler and types.
mkdir "$work/bad"
cp "$work/tsconfig.json" "$work/bad/"
sed 's/"gridPos"/"gridPosition"/' "$work/k3serve.ts" > "$work/bad/bad.ts"
if (cd "$work/bad" && "$tsc" -p tsconfig.json > "$work/bad/out.txt" 2>&1); then
  echo "FAIL: a dashboard with a misspelt field type-checked" >&2; exit 1
fi
grep -q "gridPosition" "$work/bad/out.txt" || { cat "$work/bad/out.txt" >&2; exit 1; }
echo "ok: a misspelt field is rejected"
