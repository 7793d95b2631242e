// Validates every object of the multi-document YAML files given as arguments against the
// Kubernetes OpenAPI schemas (npm kubernetes-models; monitoring.coreos.com from
// @kubernetes-models/prometheus-operator). Prints one line per object; exits 1 if any fails or
// has a kind it has no model for. Run from a folder whose node_modules holds those packages.
import fs from "node:fs";
import yaml from "js-yaml";

const modules = {
  "v1": "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "policy/v1": "kubernetes-models/policy/v1",
  "rbac.authorization.k8s.io/v1": "kubernetes-models/rbac.authorization.k8s.io/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};

let failed = 0;
let count = 0;
for (const file of process.argv.slice(2)) {
  for (const obj of yaml.loadAll(fs.readFileSync(file, "utf8"))) {
    if (obj == null) continue;
    const what = `${file}: ${obj.apiVersion} ${obj.kind} ${obj.metadata?.name}`;
    count++;
    const module = modules[obj.apiVersion];
    const Model = module && (await import(module))[obj.kind];
    if (!Model) {
      console.log(`FAIL ${what}: no model for this apiVersion and kind`);
      failed++;
      continue;
    }
    try {
      new Model(obj).validate();
      console.log(`ok   ${what}`);
    } catch (e) {
      console.log(`FAIL ${what}: ${e.message}`);
      failed++;
    }
  }
}
console.log(`${count} objects, ${failed} failed`);
process.exit(failed > 0 || count === 0 ? 1 : 0);
