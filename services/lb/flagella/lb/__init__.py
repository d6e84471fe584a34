"""flagella lb service: services, backends, stable ids and Maglev tables."""
