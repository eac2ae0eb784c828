// hf_cache.mjs - Hugging Face's JavaScript Hub client (@huggingface/hub) on a huggingface_hub
// cache, for tests/test_hub_npm.sh:
//   node hf_cache.mjs download HUB_URL CACHE REPO COMMIT FILE...   downloads FILEs at COMMIT
//                                                                  (prints each snapshot path)
//   node hf_cache.mjs scan CACHE                                   scanCacheDir as JSON: per
//       repo, its revisions with their commit, refs and files ({name, blob, size}), and the
//       warnings
// Env: KILN_NPM_DIR, where tests/hub/package.json is installed.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const entry = path.join(process.env.KILN_NPM_DIR ?? "", "node_modules/@huggingface/hub/dist/index.mjs");
if (!fs.existsSync(entry)) {
  console.error(`FAIL: @huggingface/hub is not installed in KILN_NPM_DIR (${entry})`);
  process.exit(2);
}
const { downloadFileToCacheDir, scanCacheDir } = await import(pathToFileURL(entry).href);

const [mode, ...args] = process.argv.slice(2);
if (mode === "download") {
  const [hubUrl, cacheDir, repo, revision, ...files] = args;
  for (const file of files)
    console.log(await downloadFileToCacheDir({ repo, path: file, hubUrl, cacheDir, revision }));
} else if (mode === "scan") {
  const info = await scanCacheDir(args[0]);
  const out = {
    warnings: info.warnings.map(String),
    repos: info.repos.map((r) => ({
      id: r.id.name,
      type: r.id.type,
      revisions: r.revisions.map((v) => ({
        commit: v.commitOid,
        refs: [...v.refs].sort(),
        files: v.files
          .map((f) => ({
            name: path.relative(v.path, f.path),
            blob: path.basename(f.blob.path),
            size: f.blob.size,
          }))
          .sort((a, b) => (a.name < b.name ? -1 : 1)),
      })),
    })),
  };
  console.log(JSON.stringify(out));
} else {
  console.error("usage: hf_cache.mjs download HUB_URL CACHE REPO COMMIT FILE... | scan CACHE");
  process.exit(2);
}
