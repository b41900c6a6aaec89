from smfree_pg.bench.launch import main

# Spawned ranks import this module again (as __mp_main__): only the launcher runs main.
if __name__ == "__main__":
    main()
