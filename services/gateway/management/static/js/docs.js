// Swagger UI on the gateway's /openapi.json, from the files the swagger-ui-bundle-v2 package
// ships (no CDN). "Try it out" sends the dashboard's API key when one is set.
/* global SwaggerUIBundle */

const ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  tryItOutEnabled: false,
  onComplete: () => {
    const key = sessionStorage.getItem("shoal.apiKey") || localStorage.getItem("shoal.apiKey");
    if (key) ui.preauthorizeApiKey("bearer", key);
  },
});
