import { defineConfig } from "vite";

// The portal is served by the API itself under /portal (app/portal/router.py): no CDN, no
// second server. `make run` and `make test` build it into app/portal/dist.
export default defineConfig({
  base: "/portal/",
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  build: {
    outDir: "../app/portal/dist",
    emptyOutDir: true,
    sourcemap: true,
    chunkSizeWarningLimit: 1024,
  },
});
